"""Reading Plans (and generated Programs): text tables, summary, explain, diff, recipe comparison, HTML report.

Everything here reads serialized Plan fields only, so a plan loaded from JSON shows the same as a fresh one.
"""
from autopar.inspect.compare import compare_table
from autopar.inspect.explain import diff, explain
from autopar.inspect.program import format_program
from autopar.inspect.report import write_report
from autopar.inspect.table import format_plan, format_summary
from autopar.inspect.techniques import TECHNIQUES, batch_axes, matmul_roles, techniques, techniques_text, tensor_axes

__all__ = ["format_plan", "format_summary", "explain", "diff", "techniques", "techniques_text", "TECHNIQUES",
           "batch_axes", "tensor_axes", "matmul_roles", "compare_table", "write_report", "format_program"]
