from vf_arith.taskset import ArithTaskset

__all__ = ["ArithTaskset"]
