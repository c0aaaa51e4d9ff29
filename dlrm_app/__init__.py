"""dlrm_app: DLRM training and serving on recsys_core."""
