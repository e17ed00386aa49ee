"""The ranges where sampling's maths stays finite in fp32 (logits / T, then softmax), shared by
the target (runtime/sampling.py) and the gateway's validation (torch-free: the gateway does not
import torch). Below GREEDY_BELOW the distribution is the argmax's for every practical purpose and
a division by it can overflow to inf (NaN after softmax), so it is greedy (vLLM treats T < 1e-5 the
same way); above MAX_TEMPERATURE it is refused (T beyond fp32's range is inf, and -inf / inf is
NaN)."""
from __future__ import annotations

GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 1e4
MAX_TOP_K = 2**31 - 1                   # the wire's int32
MAX_TOP_LOGPROBS = 20                   # top_logprobs per position (vLLM's default max_logprobs)
MAX_PENALTY = 2.0                       # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MIN_REPETITION_PENALTY = 0.01           # repetition_penalty in [0.01, 10] (1 = off): a logit
MAX_REPETITION_PENALTY = 10.0           # divided by less could overflow fp32 to inf
