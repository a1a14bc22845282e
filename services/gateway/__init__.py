"""The gateway service: the public API (text in, streamed text out) in front of one or more verifiers."""
