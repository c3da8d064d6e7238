"""`hybridkv bench gdn`: the GDN kernels beside FLA, FlashQLA and FlashInfer (`command`), prefill shapes and decode
steps in engine-shaped slot pools (`cases`), their rows (`rows`), timers (`timing`), baselines (`baselines`,
`flashinfer_args`), first-call warm-ups (`warmup`), and the `--breakdown` / `--host-profile` modes (`breakdown`,
`host_profile`)."""
