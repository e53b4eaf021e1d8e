"""What users run over many inputs, one module each: ``extract`` (typed records from many
documents, in process), ``distributed`` (the same on Ray Data), ``drafter_data`` (training
prompts for a drafter) and ``train_drafter`` (a head and a corpus for a target). The benchmark
harnesses live in ``constrained_spec.bench``.

Nothing is re-exported here, so ``constrained_spec.pipelines.extract`` stays the module."""
