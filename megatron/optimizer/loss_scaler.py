"""Loss scaling for fp16 training (dynamic) and the unscaled bf16/fp32 path (constant)."""

from __future__ import annotations

from typing import Protocol


class LossScaler(Protocol):
    @property
    def scale(self) -> float: ...

    @property
    def inv_scale(self) -> float: ...

    def update(self, found_overflow: bool) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ConstantLossScaler:
    """A fixed scale (1.0: no scaling, the bf16 and fp32 path)."""

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0.0:
            raise ValueError(f"scale={scale} must be > 0")
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def update(self, found_overflow: bool) -> None:
        """A constant scale ignores overflows (the iteration is still skipped)."""

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])


class DynamicLossScaler:
    """Backs off on overflow (never below min_scale; after `hysteresis` overflows, as
    Megatron's DynamicGradScaler); grows after growth_interval clean iterations in a row."""

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 1,
    ) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"initial_scale={initial_scale} must be > 0")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor={growth_factor} must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor} must lie in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval} must be >= 1")
        if hysteresis < 1:
            raise ValueError(f"hysteresis={hysteresis} must be >= 1")
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"min_scale={min_scale} must lie in (0, initial_scale={initial_scale}]")
        self._scale = float(initial_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self._clean_in_a_row = 0
        self._overflows_left = self.hysteresis

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def update(self, found_overflow: bool) -> None:
        """Megatron's policy: an overflow backs off once `hysteresis` overflows have been
        seen since the scale last grew; growth restores the hysteresis."""
        if found_overflow:
            self._clean_in_a_row = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._clean_in_a_row += 1
        if self._clean_in_a_row == self.growth_interval:
            self._scale *= self.growth_factor
            self._clean_in_a_row = 0
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self._scale, "clean_in_a_row": self._clean_in_a_row,
                "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._clean_in_a_row = int(state["clean_in_a_row"])
        self._overflows_left = int(state.get("overflows_left", self.hysteresis))
