"""One module per question this project measures (see benchmarks/README.md); run from the repository root as
`python -m benchmarks.<name> ...`. Each writes benchmarks/results/<name>.json, from which
`python -m benchmarks.make_results` regenerates docs/results.md."""

import os

# Loading a model imports DeepSpeed when it is installed, which probes for an accelerator and warns on a CPU machine
# unless told which one it is: set before any benchmark imports transformers (a user's own setting wins).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
