"""One verify step: the draft trees packed into the step's layout (``tree_batch.py``), the step as a
CUDA graph (``cuda_graphs.py``), the pure-torch reference (``reference.py``), sampling, penalties,
logprobs, the numerical guard and structured output's grammar masks."""
