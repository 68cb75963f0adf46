"""The records runs write and the report reads: what each kind holds (:mod:`.schema`) and how record files are
written and read back (:mod:`.io`)."""
