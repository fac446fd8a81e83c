"""One verify step: the draft trees planned into the step's packed input (native ``_native.pack_plan``,
``csrc/step_rows.h``; ``tree_batch.py`` its numpy reference), the step's forward part and greedy tail,
eager or as CUDA graphs (``cuda_graphs.py``), the pure-torch reference (``reference.py``), sampling,
penalties, logprobs, the numerical guard and structured output's grammar masks."""
