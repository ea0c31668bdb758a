"""The decoding engine: the speculative loop (decoding), batched decoding
(batch), the block-size policy and proposals, sampling, cache rollback, and
the draft and target wrappers."""
