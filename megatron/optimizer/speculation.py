"""What decides how the next iteration speculates: the schedule it runs with ("async":
steps before the verdict; "sync" until `post_validation_after` clean iterations in a row)
and the clip factor its speculative steps assume (the last clean iteration's, so that the
correction is small). Both are checkpointed state: the corrected bits depend on them."""

from __future__ import annotations

MODES = ("async", "sync")


class Speculation:
    def __init__(self, mode: str, post_validation_after: int, clip_grad: float) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; expected one of {MODES}")
        if post_validation_after < 0:
            raise ValueError(f"post_validation_after={post_validation_after} must be >= 0")
        if clip_grad < 0.0:
            raise ValueError(f"clip_grad={clip_grad} must be >= 0 (0 disables clipping)")
        self.mode = mode
        self.post_validation_after = int(post_validation_after)
        self.clip_grad = float(clip_grad)
        self.clean_in_a_row = 0
        # The clip factor of the last iteration that did not overflow: what a speculative
        # step assumes, so that its correction is small (1.0 until a norm is known).
        self.predicted_clip = 1.0

    def next_mode(self) -> str:
        """The schedule the next iteration runs with."""
        if self.mode == "async" and self.clean_in_a_row < self.post_validation_after:
            return "sync"
        return self.mode

    def speculative_clip(self) -> float:
        """The clip factor the next iteration's speculative steps use."""
        return self.predicted_clip if self.clip_grad > 0.0 else 1.0

    def ended(self, overflow: bool, clip: float) -> None:
        """An iteration ended with this verdict."""
        if not overflow:
            self.predicted_clip = clip
        self.clean_in_a_row = 0 if overflow else self.clean_in_a_row + 1

    def state_dict(self) -> dict:
        return {"predicted_clip": self.predicted_clip, "clean_in_a_row": self.clean_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        clip = float(state["predicted_clip"])
        if not 0.0 < clip <= 1.0:
            raise ValueError(f"predicted_clip={clip} must lie in (0, 1]")
        self.predicted_clip = clip
        self.clean_in_a_row = int(state["clean_in_a_row"])
