"""Evaluation of the training job (collective): the consensus model, the rank models, the
consensus distance."""

import math

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from ..core import deadline


def reduce(comm, values, timeout, op=MPI.SUM):
    """Sum (or ``op``) a number or a list of numbers over ranks, under the job's deadline."""
    out = deadline.allreduce(comm, np.asarray(values, dtype=np.float64), timeout=timeout,
                             op="train (reduce metrics)", reduce=op)
    return out if np.ndim(out) == 0 else out.tolist()


def accuracy(model, x, y, batch=1024):
    """(correct predictions, summed cross-entropy) of ``model`` on ``x, y``."""
    model.eval()
    with torch.no_grad():
        correct, loss = 0, 0.0
        for lo in range(0, len(x), batch):
            logits = model(x[lo:lo + batch])
            loss += float(F.cross_entropy(logits, y[lo:lo + batch], reduction="sum"))
            correct += int((logits.argmax(1) == y[lo:lo + batch]).sum())
    model.train()
    return correct, loss


#: Each rank's own model is evaluated on at most this many test samples (the first ones):
#: every rank evaluating the whole test split at every evaluation would cost P times the
#: consensus model's evaluation, which the ranks share.
RANK_EVAL_SAMPLES = 2000


class Evaluator:
    """Evaluates the consensus model (exact mean over ranks of the parameters and of the
    BatchNorm statistics, in a model of its own) on the test split, shared out over the
    ranks, and each rank's own model on the first :data:`RANK_EVAL_SAMPLES` test samples."""

    def __init__(self, eval_model, x_test, y_test, *, comm, timeout):
        self.model, self.x, self.y, self.comm, self.timeout = eval_model, x_test, y_test, comm, timeout

    def __call__(self, model, algo):
        comm, size, rank = self.comm, self.comm.Get_size(), self.comm.Get_rank()
        consensus = algo.consensus_parameters()
        algo.load_consensus(consensus, algo.consensus_buffers(), into=self.model)
        own_distance = 0.0
        for mean, own in zip(consensus, algo.model_buffers()):
            own_distance += float(((own.detach().double().cpu().numpy() - mean) ** 2).sum())
        distance = math.sqrt(reduce(comm, own_distance, self.timeout) / size)
        n = len(self.x)
        lo, hi = rank * n // size, (rank + 1) * n // size  # the consensus model: split the test set
        c_correct, c_loss = reduce(comm, list(accuracy(self.model, self.x[lo:hi], self.y[lo:hi])), self.timeout)
        m = min(n, RANK_EVAL_SAMPLES)
        r_correct, _ = accuracy(model, self.x[:m], self.y[:m])  # this rank's own model
        ranks = deadline.allgather(comm, (r_correct / m, math.sqrt(own_distance)), timeout=self.timeout,
                                   op="train (evaluate)")
        rank_accs = [a for a, _ in ranks]
        out = {"test_loss": c_loss / n, "test_accuracy": c_correct / n, "consensus_distance": distance,
               "rank_accuracy_mean": float(np.mean(rank_accs)), "rank_accuracy_min": float(np.min(rank_accs)),
               "rank_distances": [d for _, d in ranks]}   # each rank's model from the consensus, by rank
        if hasattr(algo, "center_parameters"):  # EASGD, ASGD: the center is the model they train
            algo.load_consensus(algo.center_parameters(), algo.consensus_buffers(), into=self.model)
            k_correct, k_loss = reduce(comm, list(accuracy(self.model, self.x[lo:hi], self.y[lo:hi])), self.timeout)
            out.update(center_loss=k_loss / n, center_accuracy=k_correct / n)
        return out
