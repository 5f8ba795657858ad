"""gradsolve: exact gradients for ensembles of ODEs by record and replay."""

from . import distributed as distributed, engines as engines, layout as layout
from . import methods as methods, petab as petab, problems as problems
from .calibrate import Calibrator as Calibrator, FitResult as FitResult, FitStatus as FitStatus
from .calibrate import multistart as multistart, transforms as transforms
from .engines import Engine as Engine, engine_names as engine_names
from .warp import register_field as register_field
from .grad import value_and_grad as value_and_grad, ValueAndGrad as ValueAndGrad
from .mesh import Mesh as Mesh
from .problem import EnsembleProblem as EnsembleProblem, Shared as Shared
from .record import record as record
from .replay import replay as replay
from .router import route as route
from .solve import solve as solve, Solution as Solution
from .status import Status as Status, TrajectoryFailure as TrajectoryFailure


from ._version import __version__ as __version__  # noqa: E402

from . import _compilation_cache  # noqa: E402

_compilation_cache.enable()
