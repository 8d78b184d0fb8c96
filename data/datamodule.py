"""The training stream: an infinite, seeded, resumable iterable of token batches."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from data.task import TokenSampler


class TokenStream(IterableDataset):
    """Yields batches ``[batch_size, seq_len]`` of token ids, forever.

    Batch ``i`` on rank ``r`` of ``world`` holds samples ``(i * world + r) * batch_size + [0, batch_size)``,
    so ranks draw disjoint samples and the stream resumes exactly from any batch index.
    """

    def __init__(self, sampler: TokenSampler, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.next_batch = 0

    def sample_ids(self, batch_index: int) -> np.ndarray:
        first = (batch_index * self.world_size + self.rank) * self.batch_size
        return np.arange(first, first + self.batch_size)

    def __iter__(self) -> Iterator[Tensor]:
        while True:
            batch = self.sampler(self.sample_ids(self.next_batch))
            self.next_batch += 1
            yield batch


class TokenDataModule(L.LightningDataModule):
    """Serves a :class:`TokenStream`; resumes at the trainer's step and splits samples across ranks."""

    def __init__(self, sampler: TokenSampler, batch_size: int) -> None:
        super().__init__()
        self.sampler = sampler
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        stream = TokenStream(self.sampler, self.batch_size, rank, world)
        if trainer is not None:
            # one batch per micro-step: resume exactly where a checkpoint left off
            stream.next_batch = trainer.global_step * trainer.accumulate_grad_batches
        return DataLoader(stream, batch_size=None, num_workers=0)


class EnsembleStream(IterableDataset):
    """Every member's own :class:`TokenStream`, batch by batch: yields ``[n_members, batch_size, seq_len]``
    (member ``k``'s batch ``i`` is the one a single run with its config would draw)."""

    def __init__(self, streams: list[TokenStream]) -> None:
        self.streams = streams

    def __iter__(self) -> Iterator[Tensor]:
        for batches in zip(*self.streams):
            yield torch.stack(batches)


class EnsembleDataModule(L.LightningDataModule):
    """Serves an :class:`EnsembleStream`; resumes at the trainer's step, as :class:`TokenDataModule` does."""

    def __init__(self, members: list[TokenDataModule]) -> None:
        super().__init__()
        self.members = members

    def train_dataloader(self) -> DataLoader:
        streams = []
        for member in self.members:
            member.trainer = self.trainer
            streams.append(member.train_dataloader().dataset)
        return DataLoader(EnsembleStream(streams), batch_size=None, num_workers=0)
