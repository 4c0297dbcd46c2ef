"""Where in the user's code something happened: the ``file:line (code)`` that errors and refusals name.

A frame is the user's when its file lies outside torch and outside this library (whose wrappers, such as
``random_sources``' torch function mode, are on the stack of every traced op). Every function returns
``''`` where no frame is the user's.
"""
from __future__ import annotations

import os
import re
import traceback

import torch
from torch import fx

TORCH_DIR = os.path.dirname(torch.__file__)
LIBRARY_DIR = os.path.dirname(os.path.abspath(__file__))


def user_frame(stack_trace: str) -> str:
    """``file:line (code)`` of the innermost frame of a recorded ``stack_trace`` (fx's ``node.stack_trace``,
    export's ``node.meta["stack_trace"]``) in the user's code."""
    lines = stack_trace.strip().splitlines()
    for k in range(len(lines) - 1, -1, -1):
        match = re.match(r'\s*File "([^"]+)", line (\d+)', lines[k])
        if match and not os.path.abspath(match.group(1)).startswith((TORCH_DIR, LIBRARY_DIR)):
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            return f"{match.group(1)}:{match.group(2)}" + (f" ({code})" if code else "")
    return ""


def user_source_location(error: BaseException) -> str:
    """``file:line (code)`` of the innermost traceback frame of ``error`` in the user's code."""
    location = ""
    for frame in traceback.extract_tb(error.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith((TORCH_DIR, LIBRARY_DIR)):
            continue
        location = f"{frame.filename}:{frame.lineno}"
        if frame.line:
            location += f" ({frame.line.strip()})"
    return location


def describe_error(error: BaseException) -> str:
    """``Type: first line of the message at file:line (code)``."""
    location = user_source_location(error)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {first_line}" + (f" at {location}" if location else "")


def describe_node(node: fx.Node) -> str:
    """``name = code`` of an fx node and, when tracing recorded it, the user's source line."""
    text = f"{node.name} = {node.format_node()}"
    location = user_frame(node.stack_trace or "")
    return f"{text} at {location}" if location else text
