"""lowconv: convert a PyTorch model's linear and attention layers to faster, smaller ops.

    converted = lowconv.convert(model, "fp8-dynamic", example_inputs=(x,))
    lowconv.save(converted, "out/")
    again = lowconv.load(model, "out/")
    report = lowconv.compare(model, converted, (x,))
    dense = lowconv.revert(converted)   # converted linears back to nn.Linear, same weights
"""
from lowconv.api import convert, load, revert, save
from lowconv.compare import compare
from lowconv.errors import LowconvError, LowconvWarning
from lowconv.recipe import Recipe, load_recipe
from lowconv.version import __version__

__all__ = ["convert", "save", "load", "compare", "revert", "Recipe", "load_recipe", "LowconvError", "LowconvWarning",
           "__version__"]
