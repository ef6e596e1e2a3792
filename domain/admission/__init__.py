"""Admission: every request, whatever door it came in by, passes the same ordered policies before it is queued and
settles with them after it ends. The order is one list (``policies.py``); each policy is one file."""
