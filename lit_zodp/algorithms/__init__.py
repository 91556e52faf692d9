"""One module per paper family; each ``training_step`` reads like the paper's pseudo-code.

``AlgorithmModule`` is the one base (backbone, privacy component, metrics, seeds, DDP reduction);
``ZerothOrderModule`` the ZO family base (perturbation engine); ``FirstOrderModule`` the first-order
private family base (per-example gradient engine, a torch optimizer). ``ALGORITHMS`` lists every
concrete algorithm; the privacy contract test suite runs over its private ones.
"""

from lit_zodp.algorithms.base import ALGORITHMS, AlgorithmModule
from lit_zodp.algorithms.dp_grape import DPGRAPE, GRAPE, DPGaLore, GaLore
from lit_zodp.algorithms.dpsgd import SGD, Adam, DPAdam, DPSGD
from lit_zodp.algorithms.dpzero import DPGD0th, DPZero, MeZO
from lit_zodp.algorithms.first_order import FirstOrderModule
from lit_zodp.algorithms.gep import GEP, NonPrivateGEP
from lit_zodp.algorithms.mezo_bcd import DPMeZOBCD, MeZOBCD
from lit_zodp.algorithms.o2nc import DPO2NC, O2NC
from lit_zodp.algorithms.pazo import PAZOM, PAZOP, PAZOS, NonPrivatePAZOM, NonPrivatePAZOP, NonPrivatePAZOS
from lit_zodp.algorithms.public_first_order import DOPESGD, DPMD, NonPrivateDOPESGD, NonPrivateDPMD
from lit_zodp.algorithms.zeroth_order import ZerothOrderModule

__all__ = ["ALGORITHMS", "Adam", "AlgorithmModule", "DOPESGD", "DPAdam", "DPMD", "DPGD0th", "DPGRAPE", "DPGaLore", "DPMeZOBCD", "DPO2NC", "DPSGD",
           "DPZero", "FirstOrderModule", "GEP", "GRAPE", "GaLore", "MeZO", "MeZOBCD", "NonPrivateDOPESGD", "NonPrivateDPMD", "NonPrivateGEP", "NonPrivatePAZOM",
           "NonPrivatePAZOP", "NonPrivatePAZOS", "O2NC", "PAZOM", "PAZOP", "PAZOS", "SGD", "ZerothOrderModule"]
