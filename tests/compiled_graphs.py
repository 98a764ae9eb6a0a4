"""A dynamo backend for tests that keeps the graphs it is given."""
import torch
import torch._dynamo
import torch.fx


class GraphRecorder:
    """Keeps each graph dynamo gives it and runs it through aot_eager (which traces the fake
    implementations and the autograd formulas, as inductor would, without compiling kernels)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)

    def targets(self) -> set[str]:
        """The call targets of every graph, the subgraphs (autograd.Function bodies) too."""
        return {str(node.target) for gm in self.graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
                for node in sub.graph.nodes}

    def lowconv_ops(self) -> set[str]:
        return {t.removesuffix(".default") for t in self.targets() if t.startswith("lowconv.")}
