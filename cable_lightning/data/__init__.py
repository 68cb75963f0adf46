"""Data, in three parts by when they run:

- the offline builder (``prepare``): ``prepare.py`` over ``sources.py``, with litdata's worker processes supervised in
  ``litdata_workers.py``; ``retrieval_set.py`` builds the encoders' retrieval sets;
- the prepared format both sides share: ``manifest.py`` (the folder and its checks, ``DataInfo``), ``tokenizers.py``,
  ``remote.py`` (an ``s3://`` prefix);
- what a run reads: ``datamodule.py`` (``TokenDataModule``, which never prepares: the CLI does that first) and
  ``windows.py`` (the evaluation windows).

Import from the submodules; this package imports nothing, so prepare's spawned workers do not pay for Lightning."""
