"""Choosing tokens: sampling parameters, the sampler, structured-output grammars and their masks."""
