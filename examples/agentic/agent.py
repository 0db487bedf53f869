"""A tiny token policy and the GRPO objective.

The policy reads everything seen so far -- prompt tokens and turn tokens -- as the sum of
their embeddings (enough for this game: the answers so far pin the secret to an interval)
and maps it through an MLP to logits over the next guess. Acting keeps that sum as its
state; training recomputes it for every turn at once with a cumulative sum.
"""

from __future__ import annotations

import torch
from torch import nn

from game import PAD


class Agent(nn.Module):
    """The policy: embeddings of ``vocab_size`` tokens -> MLP -> logits over
    ``num_actions`` guesses (``dim``: embedding size, ``hidden``: MLP width)."""

    def __init__(self, vocab_size: int, num_actions: int, *, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=PAD)
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, num_actions))

    # -- acting (env workers): one turn at a time --------------------------------------

    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        """State after reading the prompt, ``[n, L] -> [n, dim]``."""
        return self.embed(prompt).sum(1)

    def observe(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """State after one more turn token per game."""
        return state + self.embed(tokens)

    @torch.no_grad()
    def act(self, state: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample a guess per game; returns ``(guess, log-prob of that guess)``."""
        logp = self.head(state).log_softmax(-1)
        guess = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        return guess, logp.gather(1, guess[:, None]).squeeze(1)

    # -- training: every turn of a batch of episodes at once ---------------------------

    def log_probs(self, prompt: torch.Tensor, turns: torch.Tensor, guesses: torch.Tensor
                  ) -> torch.Tensor:
        """Log-prob of each turn's guess given what was seen before it: ``[n, T]``."""
        e = self.embed(turns)
        before = self.start(prompt)[:, None] + e.cumsum(1) - e  # prompt + earlier turns
        return self.head(before).log_softmax(-1).gather(2, guesses[..., None]).squeeze(2)


def grpo_advantages(reward: torch.Tensor, uid: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalized rewards: ``(r - mean) / (std + eps)`` within each ``uid``."""
    adv = torch.empty_like(reward)
    for key in uid.unique():
        group = uid == key
        r = reward[group]
        adv[group] = (r - r.mean()) / (r.std() + eps)
    return adv


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor,
              mask: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """Clipped policy-gradient loss summed over the turns where ``mask`` is true.

    ``old_logp`` is what the (possibly older) acting policy gave; the ratio corrects for
    the lag and the clip bounds the step, as in PPO/GRPO.
    """
    ratio = (logp - old_logp).exp()
    adv = advantage[:, None]
    per_turn = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    return torch.where(mask, per_turn, 0.0).sum()
