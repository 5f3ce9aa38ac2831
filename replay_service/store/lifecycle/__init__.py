"""What happens to a run over time: its journal of events (`journal`) and its removal by retention (`retention`)."""
