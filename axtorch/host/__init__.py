"""The machine a process runs on: its CPU's identity and axtorch's cache on it. The bottom of the
package stack beside ``config``: any package may use it, it uses none."""
