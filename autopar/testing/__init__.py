"""Helpers shipped for tests (rule checks against real execution, distributed workers); import the submodules."""
