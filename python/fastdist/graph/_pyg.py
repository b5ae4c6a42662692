"""torch_geometric is an optional extra of fastdist.graph: imported here, on first use, with an error naming it."""
from __future__ import annotations

import importlib
import types

EXTRA_HINT = ("pip install torch-geometric (fastdist's optional 'graph' extra; a pure-Python install is enough, "
              "torch-scatter and torch-sparse are not needed)")


def require(module: str = "torch_geometric") -> types.ModuleType:
    """Imports `module` of torch_geometric, or raises ImportError saying which extra to install.

    Args:
        module: A module path inside torch_geometric, e.g. "torch_geometric.utils".

    Returns:
        The imported module.

    Raises:
        ImportError: torch_geometric is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"fastdist.graph: this part needs torch_geometric ({module}); {EXTRA_HINT}") from e
