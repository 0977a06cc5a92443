"""User-level privacy: epsilon per *person* when one person writes many training examples, on CPU.

Synthetic "messages": 300 users write 1 to 20 short messages each (random token ids with a per-user favourite
token, so users differ); a tiny decoder learns to classify which of 4 topics a message is about.  With
``privacy_unit="user"`` the engine Poisson-samples users (``batch_size`` is the expected number of *users* per
batch), clips the sum of each sampled user's gradients once, and reports epsilon per user.  Nothing is
downloaded.

    python examples/user_level.py            # a few seconds on 2 cores
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath import PLDAccountant, SubsampledGaussian
from dpsgd import BatchMemoryManager, PrivacyEngine
from dpsgd.demo import TinyLlama

VOCAB, LENGTH, TOPICS = 24, 12, 4


def messages(users: int, seed: int) -> tuple[TensorDataset, list[int]]:
    """Each user's messages (token ids, topic) and each message's author."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 21, (users,), generator=g)
    author = torch.arange(users).repeat_interleave(counts)
    topic = torch.randint(0, TOPICS, (len(author),), generator=g)
    ids = torch.randint(TOPICS + 1, VOCAB, (len(author), LENGTH), generator=g)
    ids[:, 0] = topic + 1                                   # the topic's marker token opens the message
    favourite = torch.randint(TOPICS + 1, VOCAB, (users,), generator=g)
    ids[:, -1] = favourite[author]                          # every user signs off with their own token
    return TensorDataset(ids, topic), author.tolist()


def main(users: int = 300, epsilon: float = 4.0, epochs: int = 2, seed: int = 0) -> float:
    torch.manual_seed(seed)
    data, author = messages(users, seed)
    model = TinyLlama(VOCAB, LENGTH, dim=16, heads=2, layers=1, classes=TOPICS)
    engine = PrivacyEngine()
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        data_loader=DataLoader(data, batch_size=30),         # 30 users per batch, expected
        criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0, target_epsilon=epsilon, target_delta=1e-5,
        epochs=epochs, estimator="ghost",
        privacy_unit="user", user_ids=author, max_examples_per_user=8)
    for _ in range(epochs):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=128, optimizer=optimizer) as batches:
            for x, y in batches:                                # each physical batch holds whole users
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(data.tensors[0]).argmax(1) == data.tensors[1]).float().mean().item()
    per_user = engine.get_epsilon(1e-5)
    # the epsilon an example-level run would have printed at the same noise: the rate of one message, not of one
    # person (it is not a bound on a person's privacy: one person is up to 8 messages in a step)
    example_rate = 30 / len(author)
    per_message = PLDAccountant().compose(SubsampledGaussian(noise_multiplier=engine.noise_multiplier,
                                                             sample_rate=example_rate), engine.steps).epsilon(1e-5)
    print(f"{users} users, {len(author)} messages; {engine.steps} steps at user rate q_u = {engine.sample_rate:.3g}, "
          f"sigma = {engine.noise_multiplier:.3f}")
    print(f"training accuracy {accuracy:.2f}")
    print(f"epsilon per user (delta 1e-5): {per_user:.2f}   "
          f"[charged at the message rate it would read {per_message:.2f}, which is not a per-user bound]")
    return per_user


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the initial model only")
    args = parser.parse_args()
    main(args.users, args.epsilon, args.epochs, args.seed)
