"""ADMM training of recurrent networks (ADMMiRNN): gradient-free, block-wise training of an unrolled tanh RNN."""
from fastdist.admm.admmirnn import (BLOCKS, TANH_CURVATURE, ADMMDivergenceError, ADMMiRNN, RNNClassifier,
                                    SweepStats)

__all__ = ["BLOCKS", "TANH_CURVATURE", "ADMMDivergenceError", "ADMMiRNN", "RNNClassifier", "SweepStats"]
