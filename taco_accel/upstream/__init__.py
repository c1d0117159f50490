"""The upstream libraries' private names, one adapter module per library.

taco_accel extends Accelerate, transformers (its models and its Trainer), peft and TRL where
they offer no public extension point, and fixes their arithmetic where it is wrong under tensor
parallelism (and reads one private name of torch.distributed: a process group's store); each private name it relies on is read or called here and nowhere else, so that a
new upstream version is checked in one place: each module's ``SUPPORTED`` range and
``check_version`` (a `ConfigError` naming the range), called by the entry points that need the
library (`taco_accel.Accelerator`, `taco_trainer`, `parallelize` of a transformers model, the
LoRA functions), never at import: ``import taco_accel`` and the codec work with any version
installed. tests/test_upstream.py checks each name's behaviour where it is relied on. Public
names are used directly by their callers. A leaf above `errors`: any layer may import it.
"""
