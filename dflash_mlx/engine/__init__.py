"""The decoding engine: the speculative loop (decoding), batched decoding
(batch), the block-size policy and proposals, sampling, cache rollback, the
draft and target wrappers, and the store of target features for training."""
