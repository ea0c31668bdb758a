"""The decoding engine: the speculative loop (decoding) and its argument
checks (checks), batched decoding (batch), the block-size policy and the
round times it learns from (policy, timing), proposals, sampling, cache
rollback, and the draft and target wrappers."""
