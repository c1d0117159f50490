"""The upstream libraries' private names, one adapter module per library.

taco_accel extends Accelerate, transformers' Trainer, peft and TRL where they offer no public
extension point; each private name it relies on is read or called here and nowhere else, so
that a new upstream version is checked in one place: each module's `check_version` (a clear
error naming the supported range), and tests/test_upstream.py, a contract test per private
name (it exists, with the signature used here). Public names are used directly by their
callers. Only `integrations/` imports this package.
"""
