"""The vLLM tests' shared secret is in the environment before any test starts a peer process
(harness.SECRET_ENV), whichever test file runs alone."""

from tests.vllm import harness  # noqa: F401  (sets harness.SECRET_ENV)
