"""What run/, training/ and analysis/ share, below all three: bench cards and prompt streams, result files and
the run's provenance, safe writes, machine load, the part files and process group of several processes, the files
method packages declare, drafter folders, paper preset files."""
