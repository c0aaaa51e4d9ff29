"""Ready-made models (TorchRec's ``torchrec.models``): DLRM and its variants, DeepFM."""

from recsys_core.models.deepfm import SimpleDeepFMNN
from recsys_core.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain

__all__ = ["DLRM", "DLRMTrain", "DLRM_DCN", "DLRM_Projection", "SimpleDeepFMNN"]
