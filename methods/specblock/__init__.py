"""SpecBlock (paper: block-iterative drafting with a rank head), one module per job:

- ``drafter``: the registered drafters (``specblock`` and its Table 2 ablations): blocks, starts, the tree;
- ``model``: the drafter network (paper §3.1-3.2);
- ``objective``: the training loss (paper §3.3);
- ``trainer``: `specbench train specblock`;
- ``checkpoint``: our drafter folders and the published layout;
- ``adapt``: serving-time adaptation (``specblock-adapt``, ``specblock-osd``);
- ``report``: the rank head's report table."""
