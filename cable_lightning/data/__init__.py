"""Data: text sources -> tokenizers -> prepare (litdata train chunks, a flat held-out array, a manifest) ->
TokenDataModule. Import from the submodules; this package imports nothing, so prepare's spawned workers do not
pay for Lightning."""
