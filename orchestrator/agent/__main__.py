"""`python -m orchestrator.agent`: how every provider starts a node's agent."""
import sys

from orchestrator.agent.node import main

sys.exit(main())
