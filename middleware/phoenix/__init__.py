"""What Phoenix's routing (``middleware.routing``) and recovery (``middleware.recovery``)
both stand on, pure: role ids (:mod:`.ids`), the Chord ring (:mod:`.ring`), the
topology and the message kinds (:mod:`.protocol`).  Both packages import these from
here, and neither from the other for them."""
