"""Drop-in functional APIs of other projects, in plain torch, so their models run anywhere and
lowconv's passes can recognize their calls (sptr.py: SparseTransformer, used by SphereFormer;
sptr_install.py: the callables of a real SpTr install that these stand for), and what each
library's code needs of lowconv's tracer (trace_hooks.py; SpTr's in sptr_install.py, timm's in
timm.py, transformers' in transformers.py, flash-attn's varlen calls in flash_attn.py)."""
