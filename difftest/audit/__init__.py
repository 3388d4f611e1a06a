"""Checks settled before the first matmul: weights, vocab mapping, config, target capture.

Every check returns Findings; a finding names a cause from difftest.diagnosis.CAUSES.
"""
