"""Wire schemas, subject names, tiers and configuration shared by every Switchyard component."""
