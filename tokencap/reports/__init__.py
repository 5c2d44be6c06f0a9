"""Boards and reports: progress lines, the live board, rates, the HTML report."""
