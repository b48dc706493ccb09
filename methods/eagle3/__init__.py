"""EAGLE-3: ``drafter`` (the network, its training-time-test loss and the registered drafter) and
``trainer`` (`specbench train eagle3`)."""
