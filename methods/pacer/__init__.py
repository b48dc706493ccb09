"""PACER: ``drafter`` (the registered drafters: SpS whose chain the pre-verification layer stops), ``model``
(the pre-verification layer), ``checkpoint`` (its save and load), ``packing`` (training sequences and batches),
``objective`` (its loss, accuracy and AUC), ``trainer`` (`specbench train pacer`) and ``report`` (the
draft-length histogram table)."""
