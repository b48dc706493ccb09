"""PACER: ``drafter`` (the pre-verification layer, its packing and loss, the registered drafters),
``trainer`` (`specbench train pacer`) and ``report`` (the draft-length histogram table)."""
