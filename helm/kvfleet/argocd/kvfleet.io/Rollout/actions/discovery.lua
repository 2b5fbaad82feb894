-- Which rollout requests apply now; the operator would ignore (and say so in an event) any
-- other. promote names the step it was made for, so it needs a current step.
local actions = {}
local phase = "Idle"
local step = nil
local kept = false
if obj.status ~= nil then
  if obj.status.phase ~= nil then
    phase = obj.status.phase
  end
  step = obj.status.currentStep
  kept = obj.status.previousRevision ~= nil
end
local running = phase == "Shadow" or phase == "Progressing"
local paused = phase == "Paused"
actions["promote"] = {["disabled"] = not ((running or paused) and step ~= nil),
                      ["displayName"] = "Promote the current step"}
actions["promote-full"] = {["disabled"] = not (running or paused),
                           ["displayName"] = "Promote fully (skip analysis)"}
actions["abort"] = {["disabled"] = not (running or paused)}
actions["retry"] = {["disabled"] = not (paused or phase == "Aborted" or phase == "RolledBack"
                                        or phase == "RollingBack")}
actions["pause"] = {["disabled"] = not running}
actions["resume"] = {["disabled"] = not paused}
-- After a promotion, while the revision that served before it is kept (keepPreviousSeconds).
actions["undo"] = {["disabled"] = not (phase == "Promoted" and kept),
                   ["displayName"] = "Undo the promotion (back to the kept revision)"}
return actions
