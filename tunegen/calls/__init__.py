"""Checked calls, one type per family: what a public entry point was asked, from which the Problem
key, the outputs, the launch arguments, the PyTorch reference and `explain()` derive."""

from tunegen.calls.backward import BackwardCall
from tunegen.calls.decode import DecodeCall
from tunegen.calls.prefill import PrefillCall, Varlen

__all__ = ["BackwardCall", "DecodeCall", "PrefillCall", "Varlen"]
