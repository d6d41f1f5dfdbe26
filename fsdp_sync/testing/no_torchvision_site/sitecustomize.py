"""Loaded at interpreter start where this folder is on PYTHONPATH (tests only): see `fsdp_sync.testing.no_torchvision`."""

from fsdp_sync.testing.no_torchvision import install

install()
