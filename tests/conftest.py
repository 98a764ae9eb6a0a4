"""Without CUDA, Triton kernels run in Triton's interpreter (torch CPU tensors in, numpy inside).
The switch must be on before any kernel is defined, i.e. before any test module imports lowconv."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
