"""From a job spec and the providers' offers to a ranked plan: cost of the whole run per offer."""
