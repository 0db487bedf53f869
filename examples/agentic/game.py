"""Guess-the-number: a small multi-turn environment whose observations are tokens.

The game thinks of a secret in ``[0, hi)`` and tells the player ``hi`` (the prompt). Each
turn the player guesses; the game answers *higher*, *lower* or *correct*. A game is won
when the secret is guessed within ``max_turns`` guesses. Playing at random wins about a
quarter of the games; binary search wins nearly all of them.

Everything the player sees is a token: the prompt is ``[BOS, <hi>]`` and each turn adds
one token that encodes the guess together with the game's answer to it. A game that is
over answers ``PAD``, so every episode has exactly ``max_turns`` turn tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS = 0, 1
HIGHER, LOWER, CORRECT = 0, 1, 2  # the game's answer: the secret is higher / lower / equal
ANSWERS = ("higher", "lower", "correct")


@dataclass(frozen=True)
class GuessTheNumber:
    """The rules and the token vocabulary.

    Args:
        max_number: the largest range; each task picks ``hi`` in ``[max_number // 2,
            max_number]`` and a secret in ``[0, hi)``.
        max_turns: guesses allowed per game.
    """

    max_number: int = 16
    max_turns: int = 4

    @property
    def num_actions(self) -> int:
        """Possible guesses: ``0 .. max_number - 1``."""
        return self.max_number

    @property
    def vocab_size(self) -> int:
        return self._turn_base + 3 * self.max_number

    # token ids: PAD, BOS, then one per range ``hi`` (the prompt), then one per (guess, answer)
    _hi_base = 2

    @property
    def _turn_base(self) -> int:
        return self._hi_base + self.max_number + 1

    def sample_task(self, gen: torch.Generator) -> tuple[int, int]:
        """A task instance ``(hi, secret)``."""
        hi = int(torch.randint(self.max_number // 2, self.max_number + 1, (), generator=gen))
        secret = int(torch.randint(0, hi, (), generator=gen))
        return hi, secret

    def prompt(self, hi: int) -> torch.Tensor:
        """The initial observation: ``[BOS, <hi>]``."""
        return torch.tensor([BOS, self._hi_base + hi])

    def turn_token(self, guess: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        return self._turn_base + 3 * guess + answer

    def decode(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(guess, answer)`` of turn tokens (meaningless where ``tokens == PAD``)."""
        t = (tokens - self._turn_base).clamp(min=0)
        return t // 3, t % 3

    def score(self, turns: torch.Tensor, secret: torch.Tensor) -> torch.Tensor:
        """1.0 for each game (row of ``turns``, ``[n, max_turns]``) that guessed its secret."""
        guess, _ = self.decode(turns)
        return ((guess == secret[:, None]) & (turns != PAD)).any(1).float()

    def play(self, hi: int, secret: int, n: int) -> "Games":
        """``n`` games of one task instance, played in lockstep (one GRPO group)."""
        return Games(self, hi, secret, n)

    def describe(self, prompt: torch.Tensor, turns: torch.Tensor) -> str:
        """One game as text, for humans."""
        hi = int(prompt[1]) - self._hi_base
        guess, answer = self.decode(turns)
        moves = [f"{g}? {ANSWERS[a]}"
                 for t, g, a in zip(turns.tolist(), guess.tolist(), answer.tolist()) if t != PAD]
        won = bool((answer[turns != PAD] == CORRECT).any())
        return f"a number below {hi}: " + ", ".join(moves) + ("" if won else " (lost)")


class Games:
    """``n`` copies of one game, stepped together (a vectorized env)."""

    def __init__(self, rules: GuessTheNumber, hi: int, secret: int, n: int):
        self.rules = rules
        self.secret = secret
        self.prompt = rules.prompt(hi).repeat(n, 1)
        self.over = torch.zeros(n, dtype=torch.bool)

    def step(self, guess: torch.Tensor) -> torch.Tensor:
        """Answer one guess per game; returns the turn tokens (``PAD`` for games already
        over)."""
        answer = torch.full_like(guess, CORRECT)
        answer[guess < self.secret] = HIGHER
        answer[guess > self.secret] = LOWER
        tokens = self.rules.turn_token(guess, answer).masked_fill(self.over, PAD)
        self.over = self.over | (answer == CORRECT)
        return tokens
