"""DFlash: ``drafter`` (the block drafter network, its loss and the registered drafter; ``ddtree`` drafts
with it too) and ``trainer`` (`specbench train dflash`)."""
