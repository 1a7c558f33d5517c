"""Speculative decoding's parts: its configuration (``--speculative-config``), proposers
that guess the next tokens cheaply, and the verification that keeps the output exactly
the target model's (greedy: the drafts equal to its argmax; sampling: rejection sampling).
"""
